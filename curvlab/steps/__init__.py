"""Step measurements, between the optimizers and the analyses: the next step an optimizer would take, with no
trace left (``next_update``), the other arm's shadow state and the controls' twins, and the sharpness a step
sees through its preconditioner (the stability instruments)."""
