"""The fleet receiver: collect what devices publish over MQTT into the fleet DB (SQLite, or PostgreSQL for scale),
and steer them with commands.

- `fleet.store`: the fleet DB (devices, status history, active configs, tuning records, telemetry, commands);
- `fleet.db`: the same store on PostgreSQL (the dialect layer, its metadata table, its typed errors);
- `fleet.retention`: the periodic prune of old telemetry;
- `fleet.ingest`: one MQTT message (topic + payload) into the store, validating leniently and never raising on
  a malformed payload;
- `fleet.listener`: the long-running MQTT subscriber (`edgetune fleet listen`), usable as a class in tests;
- `fleet.commands`: send a command to a device and follow its responses (`edgetune fleet retune`);
- `fleet.cli`: the `edgetune fleet …` verbs.
"""
