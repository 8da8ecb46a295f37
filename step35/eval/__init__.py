"""`step35 eval`: how good is the model just trained. `metrics` holds the measurements (pass@k, the quality
gate, MTP draft acceptance) as pure functions; the command (step35/commands/eval.py) generates and feeds them."""
