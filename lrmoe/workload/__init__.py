"""What the planner, the simulator and the benchmarks are fed: model shapes, routing kinds, routed loads, routing traces."""
