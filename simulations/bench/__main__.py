"""`python -m simulations.bench SUITE ...`: see simulations.bench for the suites."""

from simulations.bench import main

main()
