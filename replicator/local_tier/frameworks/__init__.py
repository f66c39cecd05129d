"""The training frameworks the node agent speaks with through files in the client dir (Orbax today)."""
