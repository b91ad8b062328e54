from runlane.chaos.cli import main

main()
