"""May this request enter now, and on which replica: lanes, fair queue, the fit test and the score, shedding (P1,
P2, P3, P7, P9). Placement lives here because every knob it reads is an admission knob; the facts it decides from
(replica state, health) are routing's, and routing imports nothing from here (README.md)."""
