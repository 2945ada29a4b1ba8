"""`python -m ppqa` runs the command line, as the `ppqa` console script does."""

from ppqa.cli.app import main

main()
