"""Placement planning (csrc/planner): :mod:`lrmoe.planner.plan` binds the C++ planner, :mod:`lrmoe.planner.report` is ``lrmoe plan``."""
