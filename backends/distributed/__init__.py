"""Process groups, device meshes, seeding, collectives, and placement of roles on rank pools."""
