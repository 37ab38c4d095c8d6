"""The torchrun job around the ranks: starting it, its environment, each rank's failure as one
line, the board and relay through which ranks learn of a failure or a stop, and the files a run
writes at its end."""
