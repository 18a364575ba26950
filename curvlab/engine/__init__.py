"""The exact second-order engine: parameters, losses, HVPs, operators (the bottom of the math)."""
