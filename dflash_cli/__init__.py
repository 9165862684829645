"""dflash command-line interface."""
