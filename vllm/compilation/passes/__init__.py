"""Graph passes run by the pass manager; one pass per file."""
