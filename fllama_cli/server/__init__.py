"""`fllama serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over model_zoo's continuous-batching
scheduler. app.py the routes, schemas.py the request bodies, openai_format.py the answers, errors.py the error
objects, metrics.py the Prometheus metrics, runner.py uvicorn."""
