from dflash_cli.app import main

main()
