"""`python -m tierzero.cli`: the entry point torchrun starts each rank with."""

from tierzero.cli.app import main

if __name__ == "__main__":
    main()
