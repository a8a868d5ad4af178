"""A snippet that does not even compile."""
def main(:
    pass
