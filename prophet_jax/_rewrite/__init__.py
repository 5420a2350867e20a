"""The rewrite: the engine (collectives), library states, front-ends and the mesh layer."""
