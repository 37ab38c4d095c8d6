"""Process-group topology, pipeline channels and their message format."""
