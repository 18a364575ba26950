"""The stylized Kronecker quadratic model of the paper (docs/science.md section 8): the model, its optimizers,
the closed forms, and the study that runs them. Touches no training run."""
