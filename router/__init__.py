"""The router process: owns dispatch from the global Redis queue to engines (and, later, bind/release)."""
