"""Client-facing API adapters (middleware/api.py), found through ``kvgate.apis``."""
