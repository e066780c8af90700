"""Models, layers and the loader (import submodules directly; nothing heavy loads here)."""
