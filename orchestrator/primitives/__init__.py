"""What both the engine and the tools stand on: the cancellation token tree and the crash
tests' fault points. Nothing here imports the engine or the tools."""
