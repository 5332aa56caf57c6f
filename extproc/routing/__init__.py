"""What the sidecar knows about each replica: scraped engine state, its own placements, health (P6, P7, P8).
Admission decides from these facts; this package imports nothing from admission (README.md)."""
