"""A module the runner-case snippets import from their own folder; it counts its users."""
counter = 0
