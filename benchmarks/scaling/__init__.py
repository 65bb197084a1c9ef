"""Cost curves: how each stage's time and peak memory grow with its size (`python -m benchmarks.scaling`).

One benchmark in seven modules, kept together so that the driver and the pieces it runs read as one:
`__main__.py` the command, `compute.py` the numerical kernels' parts (`points.py` one point of them in a
fresh process, `predict.py` the `predict` part), `pipeline.py` the commands' parts (`commands.py` one
command in a fresh process), `fit.py` the slope fit, the table, the figure and the measured launcher the
other benchmarks share. Nothing is imported here: `python -m benchmarks.scaling.points` and the
others start without the driver's imports.
"""
