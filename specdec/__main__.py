from specdec.commands.cli import main

main()
