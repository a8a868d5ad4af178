"""What `tasks.py` runs, by concern; `tasks.py` itself is the command table.

- checkout: where the checkout, its `.venv` and `constraints.txt` are; how a command stops on a
  mistake (one line, exit 2).
- supervision: running a command's child to its own end (signals passed on, Ctrl-C waited out),
  ending what it leaves behind, and the command's temporary directory.
- install: creating `.venv` and installing exactly the pinned versions, one install at a time.
- health: the check, run inside `.venv` before every command, that the install is still whole.
- mermaid: the pinned Mermaid copy the site's diagrams load.
- child_env: the environment the commands' children run in.
- deepspeed_op: compiling DeepSpeed's CPU communication op before the tests need it.
- serve, notebook, suite: the `serve`, `notebook` and `test` commands.

Standard library only, like `tasks.py`: it runs with the system Python before `.venv` exists.
"""
