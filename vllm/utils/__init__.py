"""Small helpers shared across the package (argument parsing lives in `argparse_utils`)."""
