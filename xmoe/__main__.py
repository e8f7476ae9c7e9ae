"""`python -m xmoe ...` is the same as the `xmoe` command."""

from xmoe.cli import main

if __name__ == "__main__":
    main()
