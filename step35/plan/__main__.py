from step35.plan.cli import run

run()
