"""One MoE layer's parts on one device: config, router, the expert core, pair selection, backward statistics, activation offload."""
