"""The REST transport: the HTTP server's protocol and edge checks, request bodies, error
answers, and the route table with the routes of Triton's extensions."""
