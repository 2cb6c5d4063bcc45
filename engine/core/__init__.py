"""The engine core: the loop that schedules, runs the model and samples, apart from the HTTP front end.

`messages.py` is what crosses between the two; `loop.py` is one turn of the core (apply commands, step);
`thread.py` runs that loop on a thread of the caller's process, `process.py` in a process of its own
(`worker.py` is that process's main), the default for the server.
"""
