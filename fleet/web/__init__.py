"""The fleet server's web side (`edgetune fleet serve`): dashboard pages and the JSON API over a fleet store.

- `fleet.web.server`: the ASGI app (`create_app`); `fleet.web.app`: the guard (roles, CSRF) and rendering;
- `fleet.web.pages` / `fleet.web.api`: the HTML routes and the /api/v1/ routes with their OpenAPI schema;
- `fleet.web.views`: what each page and API route shows, shaped once from the store;
- `fleet.web.actions`: the retune action, checked and sent on the fleet command path;
- `fleet.web.auth`: tokens, signed session cookies and CSRF; `fleet.web.filters`: template formatting.
"""
