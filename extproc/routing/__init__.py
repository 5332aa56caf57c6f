"""Where a request goes: replica state, picking, and (later) scraping and health."""
