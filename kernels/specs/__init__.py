"""One module per bundled kernel; each exports SPEC."""
