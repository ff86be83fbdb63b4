from specdec.commands.cli.main import main

main()
