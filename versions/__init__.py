"""The DeepSpeed version matrix (`python3 tasks.py matrix`: versions/matrix.py).

Standard library only, in every module the matrix imports (rankrun.project is too): tasks.py
runs the matrix before anything is installed, and the tests and the MkDocs hook import it to
read the data.
"""
