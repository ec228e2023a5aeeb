"""`python -m colibri_server.http`: the gateway, as `colibri http`."""
from .serve import main

main()
