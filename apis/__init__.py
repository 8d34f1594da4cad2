"""Client-facing API adapters (middleware/framework/api.py), found through ``kvgate.apis``."""
