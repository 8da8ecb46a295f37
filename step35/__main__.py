from step35.cli import main

main()
