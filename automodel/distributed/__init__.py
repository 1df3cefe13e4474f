"""Everything that knows about ranks and meshes. Imports nothing from the rest of `automodel`."""
