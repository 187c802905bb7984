"""`python -m rnnfuse`: the same command line as the `rnnfuse` script.

Example:

    python -m rnnfuse inspect model.keras
"""

from rnnfuse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
