"""kvfleet as a Ray Serve application (KubeRay users): the engine's own server in each engine replica
(engine_replica.py over asgi_call.py), an OpenAI ingress that prepares each request once (ingress.py,
route_hint.py), kvfleet's routing policies as a Serve request router (request_router.py) fed by the engines'
KV events over Ray (kv_subscription.py), autoscaling on KV usage and waiting requests (autoscaling.py), the
application builder (app.py), `kvfleet ray up` (cli.py), the serve config and the RayService manifest."""
