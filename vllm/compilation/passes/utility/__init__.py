"""Graph passes that rewrite the model's functional ATen graph: no-op elimination, clean-up and
re-inplacing (`utility`)."""
