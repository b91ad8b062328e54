from runlane.cli import main

main()
