"""Planning: the numeric core, the simulator, the bound and plan() (pure numpy)."""
