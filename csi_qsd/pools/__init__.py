"""Where volume bytes live."""
