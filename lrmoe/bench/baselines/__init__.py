"""The baselines ``lrmoe bench layer`` measures LRMoE against: a dropless grouped-GEMM MoE and torchtitan's own MoE."""
