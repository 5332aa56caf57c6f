"""May this request enter now, and where: lanes, fair queue, saturation, shedding (P1, P2, P3, P9)."""
