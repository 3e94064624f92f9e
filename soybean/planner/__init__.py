"""Planning: the search over meshes, tilings, recomputation and memory, and the plan's record."""
