"""Library helpers shared by the library and the command line: validated argument dataclasses (`arguments`), output
folders (`outputs`), model cards (`model_card`), plots (`plotting`). Imports the runtime at most, never `tools`."""
