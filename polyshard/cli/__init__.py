"""The ``polyshard`` command."""
